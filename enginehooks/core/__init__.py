"""What an update is, independent of trainers, engines and transports: the manifest,
bucket packing and trailers, digests, dtype names, the checkpoint format (from
transformers), and the errors every part raises."""
