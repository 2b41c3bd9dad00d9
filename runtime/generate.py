"""Generation: the one token loop. `Engine.generate`, `sparseforge generate` and `chat` (runtime/chat.py), the
HTTP server, the lm-eval adapter, the scorecard and the benchmarks all run it.

It needs of an engine: `context`, `stop_ids()`, `new_cache(batch, context)`, `forward(ids, cache, logits_from)` and
`decode(token, cache, config, generator)` (runtime/engine.py Engine; eval/hf_engine.py HFEngine over transformers).
"""

from collections.abc import Iterator

import torch

from sparseforge.errors import SparseforgeError
from sparseforge.runtime.sampling import GenerationConfig, choose, make_generator


def generate(engine, prompt_ids, config: GenerationConfig | None = None) -> Iterator[int]:
    """Stream token ids after `prompt_ids` (list or 1-D tensor): the prompt in one forward, then one decode step per
    token. Stops after max_new_tokens, a stop id (which is yielded), or when the context is full."""
    config = config or GenerationConfig()
    ids = torch.as_tensor(prompt_ids, dtype=torch.long).view(1, -1)  # [1, P]
    if ids.shape[1] == 0:
        raise SparseforgeError("the prompt is empty; give at least one token id")
    if ids.shape[1] > engine.context:
        raise SparseforgeError(f"the prompt has {ids.shape[1]} tokens, more than the context of {engine.context}; shorten it or load with a larger context")
    if config.max_new_tokens == 0:
        return
    stop = set(engine.stop_ids() if config.stop_ids is None else config.stop_ids)
    generator = make_generator(config.seed)
    room = min(engine.context, ids.shape[1] + config.max_new_tokens)  # positions this request can fill
    cache = engine.new_cache(1, room)
    token = choose(engine.forward(ids, cache, logits_from=-1)[0, -1], config, generator)
    for step in range(config.max_new_tokens):
        yield token
        if token in stop or step + 1 == config.max_new_tokens or cache.length >= room:
            return
        token = engine.decode(token, cache, config, generator)
