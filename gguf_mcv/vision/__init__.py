"""Images and video in, embeddings out: media, frame sampling, slicing, the embedding cache, and
the vision encoder's backends (libmtmd, ONNX Runtime) with their converted files.
"""
