"""Running llama.cpp: the engine and its KV cache, parallel slots, kept and saved chats,
generation, structured output, and the native check.
"""
