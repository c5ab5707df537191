"""One request as its user sees it: n completions of a prompt, their text, and the result dict.

Text is made as tokens arrive, by one incremental detokenizer per completion (tokenizers'
`DecodeStream`). Decoding a token alone is wrong in general: a tokenizer may need the tokens
before it (a leading space is part of the next word's token in SentencePiece vocabularies), and
a character of several UTF-8 bytes may be cut by a token boundary. The stream decodes each new
token with a few tokens of context (the prompt's last ones at first) and holds back the bytes of
a character until it is complete.

Stop strings are searched in that text as it grows: only in the new piece plus `len(stop) - 1`
characters before it, so a stop string split across tokens is found, and nothing is searched
twice. A match cuts the text (keeping the stop string only with `include_stop_str_in_output`) and
finishes the completion as EOS would (llm.py frees it; a token computed one step late under
overlap scheduling is dropped). Text given out while a completion runs never changes afterwards:
the last `max(len(stop)) - 1` characters, which may be the start of a stop string, are held back
until more text shows they are not.

A completion that ends on a stop token (a stop id, or EOS when special tokens are not skipped)
keeps that token in `token_ids` but not its text in `text`, unless `include_stop_str_in_output`
(vLLM's rule): its last token is not fed to the detokenizer.
"""
from tokenizers.decoders import DecodeStream

from nanograph.engine.sequence import Sequence, Status

CONTEXT_TOKENS = 5  # prompt tokens decoded before the first new one, for the tokenizer's context


class Detokenizer:
    def __init__(self, tokenizer, prompt: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer.backend_tokenizer
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.stream.step(self.tokenizer, prompt[-CONTEXT_TOKENS:])
        self.num_fed = 0  # completion tokens seen
        self.text = ""

    def feed(self, token_id: int):
        """Take the completion's next token; return the text it completes."""
        self.num_fed += 1
        piece = self.stream.step(self.tokenizer, token_id) or ""
        self.text += piece
        return piece


def find_stop(text: str, new_chars: int, stops: list[str]):
    """The earliest stop string in `text` that ends in its last `new_chars` characters:
    (where it starts, which one)."""
    found = None
    for stop in stops:
        start = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
        if start >= 0 and (found is None or start < found[0]):
            found = (start, stop)
    return found


class Request:
    def __init__(self, request_id: int, prompt_token_ids: list[int], seqs: list[Sequence],
                 tokenizer=None):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.seqs = seqs  # its n completions
        self.detokenizers = None  # one per completion, with a tokenizer
        if tokenizer is not None:
            skip = seqs[0].params.skip_special_tokens
            self.detokenizers = [Detokenizer(tokenizer, prompt_token_ids, skip) for _ in seqs]

    @property
    def finished(self):
        return all(seq.status == Status.FINISHED for seq in self.seqs)

    def update_text(self, seq: Sequence):
        """Detokenize the completion's new tokens; the stop string they complete, if any."""
        if self.detokenizers is None:
            return None
        detokenizer = self.detokenizers[self.seqs.index(seq)]
        params = seq.params
        tokens = seq.completion_token_ids
        if seq.finish_reason == "stop" and not params.include_stop_str_in_output:
            tokens = tokens[:-1]  # it ended on a stop token (a stop string is found below)
        # one token at a time: a step may bring several (drafts), and a stop ends at its token
        for token in tokens[detokenizer.num_fed:]:
            piece = detokenizer.feed(token)
            if not params.stop or not piece or detokenizer.num_fed < params.min_tokens:
                continue
            found = find_stop(detokenizer.text, len(piece), params.stop)
            if found is not None:
                start, stop = found
                detokenizer.text = detokenizer.text[:start + len(stop)
                                                    * params.include_stop_str_in_output]
                seq.truncate(seq.num_prompt_tokens + detokenizer.num_fed)  # (tokens after it)
                return stop
        return None

    def completion(self, i: int):
        seq = self.seqs[i]
        text = None
        if self.detokenizers is not None:
            text = self.detokenizers[i].text
            # hold back a possible stop's start
            if seq.status != Status.FINISHED and seq.params.stop:
                text = text[:max(0, len(text) - max(map(len, seq.params.stop)) + 1)]
        token_ids = seq.completion_token_ids
        cumulative_logprob = None
        if seq.logprobs is not None:  # (each entry holds its token's)
            cumulative_logprob = sum(entry[token] for entry, token in zip(seq.logprobs, token_ids))
        return {"text": text,
                "token_ids": token_ids,
                "finish_reason": seq.finish_reason,
                "stop_reason": seq.stop_reason,
                "logprobs": seq.logprobs,
                "cumulative_logprob": cumulative_logprob}

    def result(self):
        """generate's dict: the first completion's keys at the top level, all n in `outputs`, and
        the prompt's logprobs (the request's: one entry per prompt token, the first None)."""
        outputs = [self.completion(i) for i in range(len(self.seqs))]
        return {**outputs[0], "outputs": outputs, "prompt_logprobs": self.seqs[0].prompt_logprobs}

    def step_output(self):
        """step()'s dict: the result so far, which request, whether it is finished."""
        return {"request_id": self.request_id,
                "prompt_token_ids": self.prompt_token_ids,
                **self.result(),
                "finished": self.finished}
