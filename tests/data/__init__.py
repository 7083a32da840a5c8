"""Small datasets the tests share (local files only: no test reaches the network)."""
