"""What the finish stage writes: the outbox (atomic files, the one mover of input files), mask PNGs, overlays, YOLO text
files, and the COCO export of recorded results."""
