"""Measuring the worker: statistics (percentiles, slopes, memory samples), the soak, the bench, the sample images."""
