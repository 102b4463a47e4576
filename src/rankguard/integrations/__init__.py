"""rankguard adapters: Composer, Lightning, the Hugging Face Trainer, hand-written loops."""
