"""C++ kernels for CPU serving, built on first use with the compiler torch uses."""
