"""Configuration plumbing shared by every process: the strict base model, secret redaction, the loader."""
