"""Which models exist and their files: the catalog, quant names, GGUF headers and shapes, the Hub,
file identities.
"""
