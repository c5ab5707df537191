"""Speculative decoding, an extension: drafts (ngram.py: prompt lookup) and their verification
(acceptance.py), which keeps the target's output distribution."""
