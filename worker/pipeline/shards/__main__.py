"""A prepare process's entry point: see worker/pipeline/shards/shard.py."""

import sys

from worker.pipeline.shards.shard import main

main(sys.argv[1:])
