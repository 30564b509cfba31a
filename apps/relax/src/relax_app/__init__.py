"""The relax command and the CPU demo."""
