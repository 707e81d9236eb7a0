"""Text in, token shards out, batches for every rank: corpus, tokenizers, shards and the sampler."""
