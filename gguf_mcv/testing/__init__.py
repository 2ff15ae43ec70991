"""Random-weight GGUF models with each MiniCPM-V generation's real layout, for tests and
benchmarks.
"""
