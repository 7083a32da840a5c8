"""The weight-transfer engine pairs this project registers in vLLM's factory (both sides of each pair)."""
