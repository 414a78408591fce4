"""Shared set-up for the golden generators: offline tiktoken and Hugging Face GPT-2 tokenizers
built from ptk's shipped GPT-2 files (identical to the files tiktoken pins by sha256)."""
import hashlib
import os
import shutil
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
VOCAB = os.path.join(ROOT, "tokenizer", "data", "gpt2-vocab.json")
MERGES = os.path.join(ROOT, "tokenizer", "data", "gpt2-merges.txt")

# tiktoken downloads these URLs and checks their sha256; the shipped files are those exact bytes.
TIKTOKEN_FILES = {
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe": MERGES,
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json": VOCAB,
}


def tiktoken_gpt2():
    cache = os.path.join(tempfile.gettempdir(), "ptk-tiktoken-cache")
    os.makedirs(cache, exist_ok=True)
    for url, path in TIKTOKEN_FILES.items():
        dst = os.path.join(cache, hashlib.sha1(url.encode()).hexdigest())
        if not os.path.exists(dst):
            shutil.copyfile(path, dst)
    os.environ["TIKTOKEN_CACHE_DIR"] = cache
    import tiktoken
    return tiktoken.get_encoding("gpt2")


def hf_gpt2_fast():
    """transformers' GPT2TokenizerFast (transformers 4.x), what Megatron-LM's GPT2BPETokenizer runs."""
    from transformers import GPT2TokenizerFast
    return GPT2TokenizerFast(vocab_file=VOCAB, merges_file=MERGES)
