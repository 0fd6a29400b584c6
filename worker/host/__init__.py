"""Facts of the machine the worker runs on: disks and their room, mounts, processes, locks, file names, durations as text."""
