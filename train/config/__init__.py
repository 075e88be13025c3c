"""The language of a run's config: what a key may hold (``domains``: ``Domain``, ``Key``,
the one pass that checks a config) and the command line that loads one (``cli``). The
schema itself, every key with its default, is ``train.run.schema``."""
