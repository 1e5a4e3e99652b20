"""Run the peers' own test suites (../shared/peer-tests: transformers' model tests, timm's test_models.py) plain,
with a neutral prior and with a real one on every model they build (benchmarks/peer_plugin.py), and print per file
what newly fails and how many models were given a prior (the checkout's maskprior; a mode that gave none says so).

    python benchmarks/peer_suites.py SCRATCH [--modes off,neutral,real] [--only gpt2,timm] [--deps DIR] [--peers DIR]

SCRATCH receives the unpacked suites, one JUnit XML and event log per file and mode (a run without off compares
with the off run there). --deps: the suites' own test dependencies (pip install --no-deps --target DIR
parameterized pytest-timeout httpx httpcore timeout-decorator). A file takes 1-2 minutes a mode on 2 cores.
"""
import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)                 # the checkout's maskprior, whatever is installed
FILES = {                                  # name: (suite, test file, pytest -k)
    "gpt2": ("hf", "tests/models/gpt2/test_modeling_gpt2.py", None),
    "llama": ("hf", "tests/models/llama/test_modeling_llama.py", None),
    "mistral": ("hf", "tests/models/mistral/test_modeling_mistral.py", None),
    "qwen2": ("hf", "tests/models/qwen2/test_modeling_qwen2.py", None),
    "bert": ("hf", "tests/models/bert/test_modeling_bert.py", None),
    "gemma2": ("hf", "tests/models/gemma2/test_modeling_gemma2.py", None),
    "bart": ("hf", "tests/models/bart/test_modeling_bart.py", None),
    "t5": ("hf", "tests/models/t5/test_modeling_t5.py", None),
    "timm": ("timm", "tests/test_models.py", "vit_tiny_patch16_224 or deit_tiny_patch16_224 "
                                             "or deit_tiny_distilled_patch16_224"),
}


def unpack(scratch: str, peers: str) -> None:
    for suite, archive in (("hf", "hf-tests-5.15.tar.xz"), ("timm", "timm-tests.tar.xz")):
        target = os.path.join(scratch, suite)
        if not os.path.isdir(target):
            with tarfile.open(os.path.join(peers, archive)) as tar:
                tar.extractall(target, filter="data")


def outcomes(xml_path: str) -> dict:
    """{test id: 'passed' | 'failed' | 'skipped'} from a JUnit XML file."""
    result = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        state = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
        result[f"{case.get('classname')}::{case.get('name')}"] = state
    return result


def run(scratch: str, name: str, mode: str, deps: str | None) -> tuple[dict, int]:
    """The file's outcomes in this mode (`outcomes`), and how many models the plugin gave a prior."""
    suite, path, select = FILES[name]
    xml, events = os.path.join(scratch, f"{name}-{mode}.xml"), os.path.join(scratch, f"{name}-{mode}.jsonl")
    for old in (xml, events):
        if os.path.exists(old):
            os.remove(old)
    env = dict(os.environ, MASKPRIOR_PEER=mode, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", MASKPRIOR_PEER_LOG=events,
               PYTHONPATH=os.pathsep.join(p for p in (HERE, ROOT, deps, os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "peer_plugin",
           "--timeout=300", f"--junitxml={xml}", path] + (["-k", select] if select else [])
    with open(os.path.join(scratch, f"{name}-{mode}.log"), "w") as log:
        subprocess.run(cmd, cwd=os.path.join(scratch, suite), env=env, stdout=log, stderr=subprocess.STDOUT)
    got = outcomes(xml) if os.path.exists(xml) else {}
    attached = sum(json.loads(line)["event"] == "attached" for line in open(events)) if os.path.exists(events) else 0
    return got, attached


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scratch")
    ap.add_argument("--modes", default="off,neutral,real")
    ap.add_argument("--only", default=",".join(FILES))
    ap.add_argument("--deps")
    ap.add_argument("--peers", default=os.path.join(HERE, "..", "..", "shared", "peer-tests"),
                    help="the folder holding hf-tests-5.15.tar.xz and timm-tests.tar.xz")
    args = ap.parse_args(argv)
    os.makedirs(args.scratch, exist_ok=True)
    unpack(args.scratch, args.peers)
    modes = args.modes.split(",")
    print("file | mode | passed | failed | skipped | newly failing | models given a prior | seconds", flush=True)
    for name in args.only.split(","):
        off = os.path.join(args.scratch, f"{name}-off.xml")
        base = outcomes(off) if os.path.exists(off) else None          # a run without off: the one there
        for mode in modes:
            start = time.time()
            got, attached = run(args.scratch, name, mode, args.deps)
            base = got if mode == "off" else base
            count = {k: sum(v == k for v in got.values()) for k in ("passed", "failed", "skipped")}
            new = [t for t, v in got.items() if v == "failed" and (base or {}).get(t) == "passed"]
            print(f"{name} | {mode} | {count['passed']} | {count['failed']} | {count['skipped']} | "
                  f"{'-' if mode == 'off' or base is None else len(new)} | "
                  f"{'-' if mode == 'off' else attached or 'NONE: this mode ran the plain models'} | "
                  f"{time.time() - start:.0f}", flush=True)
            with open(os.path.join(args.scratch, f"{name}-{mode}.new"), "w") as f:
                f.write("\n".join(sorted(new)) + "\n")


if __name__ == "__main__":
    main()
