"""The replay buffer as a library over Redis: records, codec, Lua-atomic insert and sample."""
