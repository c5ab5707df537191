"""`--shell`: a chat in the terminal, on the LLM's step API (no HTTP, no engine thread).

The conversation is kept and sent whole each turn, through the model's chat template; the reply
is printed as it is generated, a step at a time. `/reset` forgets the conversation, `/exit` (or
Ctrl-D) quits. A turn the engine refuses (the conversation has outgrown `max_model_len`) is
reported and forgotten.
"""
import sys

from nanograph import LLM, SamplingParams
from nanograph.llm import chat_prompt


def chat_shell(model: str, knobs: dict):
    with LLM(model, **knobs) as llm:
        if not getattr(llm.tokenizer, "chat_template", None):
            sys.exit(f"nanograph-serve: --shell needs a chat template, and {model} has none "
                     "(serve it and use /v1/completions)")
        print("nanograph chat: /reset forgets the conversation, /exit or Ctrl-D quits")
        history = []
        while (line := read_line()) is not None and line != "/exit":
            if line == "/reset":
                history.clear()
                print("(conversation reset)")
                continue
            history.append({"role": "user", "content": line})
            try:  # up to the context, as the server's default
                llm.add_request(chat_prompt(llm.tokenizer, history), SamplingParams(max_tokens=None))
            except ValueError as e:
                print(f"error: {e}")
                history.pop()
                continue
            text = ""
            while llm.has_unfinished_requests():
                for out in llm.step():
                    print(out["text"][len(text):], end="", flush=True)
                    text = out["text"]
            print()
            history.append({"role": "assistant", "content": text})


def read_line() -> str | None:
    """The user's next line, stripped; None at the end of the input (Ctrl-D)."""
    try:
        return input("> ").strip()
    except EOFError:
        return None
