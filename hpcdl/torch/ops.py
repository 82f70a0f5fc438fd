"""Horovod's reduction op values (its C++ ReduceOp enum), so that scripts comparing them work.

Their own module: the process functions, the engine and the transfers all name them, and none
of those may import another in a circle (tests/test_layers.py)."""

Average = 0
Sum = 1
Adasum = 2
Min = 3
Max = 4
Product = 5
