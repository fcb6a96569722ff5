"""Native CPU kernels (C, compiled on first use, called through ctypes); ``library`` loads them."""
