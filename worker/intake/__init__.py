"""Intake: turns files into jobs. It only enqueues; the pipeline consumes."""
