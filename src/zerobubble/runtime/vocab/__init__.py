"""Vocabulary parallelism: the sharded embedding and head, their runner and their checkpoints.

:mod:`.layers` (the arithmetic of one shard, no collectives; ``VocabParallelEmbedding`` and
``VocabParallelHead``, also ``zerobubble.VocabParallelHead``), :mod:`.runner` (the S and T ops'
collectives at run time) and :mod:`.state` (each rank's rows as DCP shards).
"""
