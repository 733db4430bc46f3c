"""`hf-paged serve`: transformers' own OpenAI-compatible server (`transformers serve`) with continuous batching on
hf_paged's engine.

    hf-paged serve MODEL [transformers serve's options]   ==   transformers serve --continuous-batching MODEL ...
                                                               with hf_paged imported where the model runs

transformers' server runs each model in a process of its own (spawned: it starts afresh, without this process'
imports). `PagedServe` hands that process a `PagedModelLoader`, whose class lives here: unpickling it there imports
hf_paged, which takes over `init_continuous_batching` (integrations/cb_manager.py), so the model's batching manager is
hf_paged's. Besides transformers' endpoints the server answers `GET /hf_paged/stats`: the engine's `stats()` of each
running model (requests running and waiting, KV blocks free, prefix-cache hits...), `{"hf_paged": false}` for a
model transformers' own manager runs. `MODEL` may be `tiny`: hf_paged's built-in random-weight chat model
(`hf_paged.tiny.tiny_chat_model`, saved to a temporary folder for the server's processes; its text is noise).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import tempfile
from pathlib import Path
from typing import Annotated

from transformers.cli.serve import Serve
from transformers.cli.serving.model_manager import ModelLoader

TINY = "tiny"
STATS_ROUTE = "/hf_paged/stats"


class PagedModelLoader(ModelLoader):
    """transformers' `ModelLoader` (a copy of the server's, with its settings), plus `aliases`: model names that load
    from a local folder. Its class is defined here so that the model's process, unpickling it, imports hf_paged."""

    aliases: dict[str, str] = {}

    @classmethod
    def of(cls, loader: ModelLoader, aliases: dict[str, str]) -> "PagedModelLoader":
        paged = cls.__new__(cls)
        paged.__dict__.update(vars(loader))
        paged.aliases = dict(aliases)
        return paged

    def _where(self, model_id: str) -> str:
        return self.aliases.get(model_id, model_id)

    def load_config(self, model_id: str):
        return super().load_config(self._where(model_id))

    def load_processor(self, model_id: str):
        return super().load_processor(self._where(model_id))

    def load_model_and_processor(self, model_id: str, on_progress=None):
        import hf_paged

        hf_paged.enable()  # imported with this class already; enabled again in case something disabled it
        return super().load_model_and_processor(self._where(model_id), on_progress)


def engine_stats(model, processor) -> dict:
    """In the model's process (`EngineClient.submit`): the engine stats of `model`'s hf_paged batching manager, or
    `{"hf_paged": False}` when transformers' own manager (or plain `generate`) serves it."""
    from .cb_manager import live_managers

    engines = [m.llm for m in live_managers() if m.model is model and m.llm is not None]
    if not engines:
        return {"hf_paged": False}
    return {"hf_paged": True, **engines[-1].stats()}


def with_stats_route(build_server, model_manager, *args, **kwargs):
    """transformers' `build_server`, plus `GET /hf_paged/stats` (see the module docstring)."""
    app = build_server(model_manager, *args, **kwargs)

    @app.get(STATS_ROUTE)
    async def hf_paged_stats():
        from fastapi.responses import JSONResponse

        running = [(model_manager.force_model or name, engine) for name, engine in list(model_manager.engines.items())
                   if engine.process_running and not engine.is_dead]  # by the name requests give
        return JSONResponse({name: await engine.submit(engine_stats) for name, engine in running})

    return app


@contextlib.contextmanager
def _stats_route():
    from transformers.cli.serving import server

    original = server.build_server
    server.build_server = functools.partial(with_stats_route, original)
    try:
        yield
    finally:
        server.build_server = original


class PagedServe(Serve):
    """transformers' `Serve` (its options, its server), the models loaded by a `PagedModelLoader`."""

    @contextlib.contextmanager
    def _paged(self):
        """The loader made a `PagedModelLoader` (once: the API servers of `run_api_servers` get it made), with the
        built-in model saved for the server's processes while it runs when MODEL is 'tiny'."""
        if isinstance(self.loader, PagedModelLoader):
            yield
            return
        with contextlib.ExitStack() as stack:
            aliases = {}
            if self.force_model == TINY and not Path(TINY).is_dir():
                aliases = _save_tiny(stack.enter_context(tempfile.TemporaryDirectory(prefix="hf_paged_tiny_")))
            self.loader = PagedModelLoader.of(self.loader, aliases)
            yield

    def run(self, socket=None, engine_connection=None) -> None:
        with self._paged(), _stats_route():
            super().run(socket, engine_connection)

    def run_api_servers(self, count: int) -> None:
        with self._paged():
            super().run_api_servers(count)


def _signature() -> inspect.Signature:
    """`Serve`'s options, continuous batching on (and its option hidden): what typer builds the command from."""
    import typer

    signature = inspect.signature(Serve)
    hidden = Annotated[bool, typer.Option(hidden=True)]
    return signature.replace(parameters=[p.replace(default=True, annotation=hidden) if p.name == "continuous_batching"
                                         else p for p in signature.parameters.values()])


PagedServe.__signature__ = _signature()
PagedServe.__doc__ = f"""transformers' OpenAI-compatible server (`transformers serve --continuous-batching`), continuous
batching on hf_paged's engine. FORCE_MODEL: a Hub id, a local folder, or 'tiny' (hf_paged's built-in random-weight
model: no download, its text is noise).

\b
Endpoints:
    POST /v1/chat/completions   chat completions (streaming or not)
    POST /v1/completions        completions of a prompt
    POST /v1/responses          the Responses API
    GET  /v1/models             the models served
    GET  /health                health check
    GET  {STATS_ROUTE}        hf_paged's engine stats of each running model
"""


def main(argv: list[str]) -> int:
    """Run `transformers serve --continuous-batching` with `argv` (its options) in this process, hf_paged enabled.
    Returns the exit status."""
    import typer

    import hf_paged

    hf_paged.enable()
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command(name="serve")(PagedServe)
    try:
        app(args=list(argv), prog_name="hf-paged serve")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


def _save_tiny(folder: str) -> dict[str, str]:
    """Save `tiny_chat_model()` and its tokenizer to `folder`; the names it goes by ('tiny', 'tiny@main') -> it."""
    from transformers.cli.serving.utils import canonical_model_id

    from ..tiny import tiny_chat_model

    model, tokenizer = tiny_chat_model()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return {TINY: folder, canonical_model_id(TINY): folder}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
