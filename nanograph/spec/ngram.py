"""Prompt lookup: draft tokens copied from earlier in the sequence itself (n-gram drafts).

Output often repeats what came before: code repeats its names and lines, a summary quotes its
source. So the cheapest guess of what comes next is what followed the last time the same few
tokens appeared. For a sequence (prompt + output) of L tokens, take its last n tokens, for n from
`prompt_lookup_max` down to `prompt_lookup_min`, and find their most recent earlier occurrence,
the one ending at `end` < L (it may overlap the suffix itself). The draft is the
`num_speculative_tokens` (k) tokens that followed it. Near the end of the sequence fewer than k
follow; the copy then runs on into the tokens it has just drafted, as an overlapping copy does
(LZ77's): the tokens from `end` on repeat with period L - end, so

    draft[j] = tokens[end + j % (L - end)]

and every match gives k drafts (`a b a b a b` drafts `a b a b ...`). No match gives none.

The search runs on the host, where the scheduler has the tokens, once per drafting sequence and
step, and its time adds to every verify step's (a verify step is collected before the next is
scheduled, so nothing hides it). So it is not a Python loop over candidate positions: the
tokens are packed as 4-byte integers into one bytes object, and `bytes.rfind` (a C search)
finds the suffix's most recent earlier occurrence; a hit at an offset that is not a multiple of
4 straddles two tokens and the search goes on before it. Its oracle, the same rule as a plain
loop over slices, is in tests/test_spec.py.
"""
from array import array


def propose_ngram(tokens: list[int], num_speculative_tokens: int, prompt_lookup_min: int,
                  prompt_lookup_max: int) -> list[int]:
    """The draft after `tokens`: k tokens, or [] when its last n tokens (any n in [min, max])
    never occurred before."""
    length = len(tokens)
    packed = array("i", tokens).tobytes()
    for n in range(min(prompt_lookup_max, length - 1), prompt_lookup_min - 1, -1):
        suffix = packed[4 * (length - n):]
        stop = len(packed) - 4  # an occurrence ending before the last token
        while (start := packed.rfind(suffix, 0, stop)) >= 0:
            if start % 4 == 0:  # (else it straddles two tokens)
                end = start // 4 + n
                period = length - end
                return [tokens[end + j % period] for j in range(num_speculative_tokens)]
            stop = start + len(suffix) - 1
    return []
