"""`hf-paged serve --help` without loading transformers (its own help takes seconds): standard library only."""


SERVE_HELP = """usage: hf-paged serve [MODEL] [transformers serve's options]

An OpenAI-compatible server: `transformers serve --continuous-batching` with its model running on hf_paged's engine
(the same endpoints: /v1/chat/completions, /v1/completions, /v1/responses, /v1/models; plus GET /hf_paged/stats).
MODEL: a Hub id or a local folder, or `tiny` (a built-in random-weight model, no download).

  hf-paged serve tiny --port 8000
  hf-paged serve Qwen/Qwen2.5-0.5B-Instruct --host 0.0.0.0

Every option of `transformers serve` applies (--host, --port, --dtype, --device, ...): `hf-paged serve --help-all`
lists them (it loads transformers: a few seconds). Needs the serve extra: pip install 'hf_paged[serve]'."""


def serve_help(options: list[str]) -> bool:
    """`hf-paged serve --help` answers at once with SERVE_HELP (transformers' own help takes seconds to load);
    `--help-all` is passed on to transformers as --help. True when the help was printed here."""
    if "--help-all" in options:
        options[options.index("--help-all")] = "--help"
        return False
    if "--help" in options or "-h" in options:
        print(SERVE_HELP)
        return True
    return False
