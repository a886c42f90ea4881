"""Native and linear-layer kernels: C kernels through ctypes, oneDNN prepacking, integer layers."""
