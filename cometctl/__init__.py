"""cometctl: orchestrator for COMET-Caffe (build, datasets, training, reports)."""

__version__ = "0.1.0"
