"""Sizes on the benchmarks' command lines: 4096, 64K, 256M, 1.5G (binary
units, the suffix in either case), as bytes."""


def parse_size(s):
    """Bytes of @s; ValueError when it is not a size."""
    s = str(s).strip()
    mult = {'K': 1 << 10, 'M': 1 << 20, 'G': 1 << 30}
    if s and s[-1].upper() in mult:
        return int(float(s[:-1]) * mult[s[-1].upper()])
    return int(s)
