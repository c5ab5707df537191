"""`--shell`: a chat in the terminal, on the same engine thread as the server (no HTTP).

The conversation is kept and sent whole each turn, through the model's chat template; the reply
is printed as it streams. `/reset` forgets the conversation, `/exit` (or Ctrl-D) quits.
"""
import asyncio

from nanograph.serve.engine_thread import EngineError, EngineThread, Job
from nanograph.serve.protocol import ChatRequest


async def chat_shell(engine: EngineThread):
    if not await asyncio.to_thread(engine.wait_ready):
        return  # the build failed: cli.py says why
    if not getattr(engine.tokenizer, "chat_template", None):
        engine.error = (f"--shell needs a chat template, and {engine.llm.config.model} has none "
                        "(serve it and use /v1/completions)")
        return
    print("nanograph chat: /reset forgets the conversation, /exit or Ctrl-D quits")
    history = []
    while True:
        try:
            line = await asyncio.to_thread(input, "> ")
        except EOFError:
            return
        command = line.strip()
        if command == "/exit":
            return
        if command == "/reset":
            history.clear()
            print("(conversation reset)")
            continue
        history.append({"role": "user", "content": line})
        text = ""
        try:
            request = ChatRequest.model_validate({"messages": history})
            params, prompts = request.prepare(engine.tokenizer, engine.llm.config.max_model_len)
            outputs = engine.generate([Job(params, prompts[0])])
            await anext(outputs)  # the engine has taken it
            async for _, out in outputs:
                print(out["text"][len(text):], end="", flush=True)
                text = out["text"]
        except (ValueError, EngineError) as e:
            print(f"error: {e}")
            history.pop()
            continue
        print()
        history.append({"role": "assistant", "content": text})
