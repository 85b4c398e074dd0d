"""Tandem: distributed, pipelined, lossless speculative decoding."""
