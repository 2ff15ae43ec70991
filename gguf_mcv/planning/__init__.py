"""What this machine can run and how fast: hardware, the memory and speed models, the speed probe,
the planner that chooses the quant.
"""
