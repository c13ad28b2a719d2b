"""Where the optimizer state lives (device memory, host memory, files) and how it is encoded."""
