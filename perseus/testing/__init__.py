"""Test doubles for Perseus' own tests and benchmarks: not used by the product.

`perseus.testing.fake_nvml` installs a fake `pynvml` (NVML without an NVIDIA GPU);
`perseus.testing.nvml_codes` holds the names the real binding exports; `perseus.testing.fake_amdsmi`
installs a fake `amdsmi` (AMD SMI without an AMD GPU), `perseus.testing.amdsmi_codes` the names the
real package exports.
"""
