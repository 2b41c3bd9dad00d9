"""Tables in the docs are the benchmark result files they name, byte for byte."""

from scripts import load_script


def _doc_tables():
    return load_script("doc_tables")


def test_render_replaces_marked_blocks(tmp_path):
    dt = _doc_tables()
    (tmp_path / "r.md").write_text("| a |\n| --- |\n| 1 |\n")
    doc = "intro\n<!-- table: r.md -->\nold\n<!-- end table -->\nafter\n"
    assert dt.render(doc, tmp_path) == "intro\n<!-- table: r.md -->\n| a |\n| --- |\n| 1 |\n<!-- end table -->\nafter\n"


def test_docs_tables_match_their_result_files():
    dt = _doc_tables()
    stale = [d.name for d in dt.docs() if dt.render(d.read_text()) != d.read_text()]
    assert not stale, f"stale tables in {stale}; run python benchmarks/doc_tables.py"


def test_local_paths(tmp_path):
    dt = _doc_tables()
    text = f"--ckpt {tmp_path}/runs/a --gguf /opt/x/m.gguf --bin <build>/bin/main ./rel/path"
    assert dt._local_paths(text, tmp_path) == "--ckpt runs/a --gguf <m.gguf> --bin <build>/bin/main ./rel/path"
