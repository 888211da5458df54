"""A tiny llama model with random weights, written as GGUF: nothing downloaded.

Two layers, hidden size 64, a 512-entry SentencePiece-style vocabulary
(the three specials, the 128 ASCII byte tokens, then "▁word" and single
letter pieces). Its answers are noise, but llama-server loads it, runs the
real llama architecture on it and counts its tokens like any other model's:
enough for the engine-counter tests (tests/features/test_real_engine.py).

Usage: python tests/real_engine/tiny_model.py OUT.gguf
"""

from __future__ import annotations

import string
import sys
from pathlib import Path

import numpy as np

N_VOCAB = 512
N_EMBD = 64
N_HEAD = 4
N_LAYER = 2
N_FF = 128
N_CTX = 4096
UNK, BOS, EOS = 0, 1, 2
#: The control tokens, which print nothing: the test bans them from answers.
SPECIALS = (UNK, BOS, EOS)

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this "
    "have from or one had by word but not what all were we when your can said there use "
    "an each which she do how their if will up other about out many then them these so "
    "some her would make like him into time has look two more write go see number no way "
    "could people my than first water been call who oil its now find long down day did get "
    "come made may part stream token engine server metric count abort cancel client"
)
WORDS = tuple(_WORDS.split())


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and types (gguf.TokenType values) of the SPM vocabulary."""
    import gguf

    tokens = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(128)]  # ASCII only: every token is valid UTF-8
    types += [gguf.TokenType.BYTE] * 128
    pieces = [f"\u2581{w}" for w in WORDS] + list(string.ascii_letters) + list(string.digits)
    pieces += [f"\u2581{c}" for c in string.ascii_lowercase]
    seen = set(tokens)
    for piece in pieces:
        if piece not in seen and len(tokens) < N_VOCAB:
            seen.add(piece)
            tokens.append(piece)
            types.append(gguf.TokenType.NORMAL)
    filler = 0
    while len(tokens) < N_VOCAB:
        tokens.append(f"\u2581w{filler}")
        types.append(gguf.TokenType.NORMAL)
        filler += 1
    scores = [0.0] * 131 + [-float(i) for i in range(N_VOCAB - 131)]
    return tokens, scores, [int(t) for t in types]


def write_tiny_model(path: Path | str, seed: int = 0) -> Path:
    """Write the model to ``path`` (about 0.5 MB) and return the path."""
    import gguf

    path = Path(path)
    rng = np.random.default_rng(seed)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("streamwarden-tiny-random")
    writer.add_context_length(N_CTX)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD)
    writer.add_rope_dimension_count(N_EMBD // N_HEAD)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(N_VOCAB)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    tokens, scores, types = vocabulary()
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)
    writer.add_unk_token_id(UNK)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    # numpy shapes are (rows, columns) = (out, in); GGUF stores them reversed.
    writer.add_tensor("token_embd.weight", weight(N_VOCAB, N_EMBD))
    for i in range(N_LAYER):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones(N_EMBD))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"blk.{i}.{name}.weight", weight(N_EMBD, N_EMBD))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones(N_EMBD))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weight(N_FF, N_EMBD))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weight(N_FF, N_EMBD))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weight(N_EMBD, N_FF))
    writer.add_tensor("output_norm.weight", ones(N_EMBD))
    writer.add_tensor("output.weight", weight(N_VOCAB, N_EMBD))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


if __name__ == "__main__":
    out = write_tiny_model(sys.argv[1] if len(sys.argv) > 1 else "tiny.gguf")
    print(out, out.stat().st_size, "bytes")
