"""Constrained answers: JSON schemas and tools as llama.cpp grammars, bounded and checked;
``pattern``s as JSON-safe grammar; only valid UTF-8 under a grammar.
"""
