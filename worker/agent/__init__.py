"""The agent: what talks to the model and the tools (``runner``: the LLM/tool loop of one
turn; ``prompt``: prompt assembly; ``providers``; ``tools``). It holds no lease and knows no
Redis key: the runtime gives it a session and takes back rows and an answer."""
