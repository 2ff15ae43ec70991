"""The vocabularies of synthetic models: byte-level BPE (GPT-2 bytes plus merges learnt
from a list of English words) or SentencePiece, then control tokens and padding."""

from __future__ import annotations

from functools import lru_cache

from .synthetic_specs import SPM_LEADING, SPM_SPECIAL_TOKENS, TOKENIZERS, SyntheticSpec

# Frequent English words (roughly by rank); BPE merges are learnt from them.
_WORDS = """
the of and to in a is that for it as was with be by on not he i this are or his
from at which but have an they you were her she there one all we their been has
when who will more no if out so said what up its about into than them can only
other new some could time these two may then do first any my now such like our
over man me even most made after also did many before must through back years
where much your way well down should because each just those people how too
little state good very make world still own see men work long get here between
both life being under never day same another know while last might us great old
year off come since against go came right used take three image picture photo
describe show color red green blue white black small large left top bottom
person people cat dog car tree house text number answer question what where
there is are this that which shows contains looks like scene background front
""".split()

def byte_tokens() -> list[str]:
    """GPT-2's 256 byte tokens (printable bytes as themselves, the rest shifted to U+0100..)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = chr(256 + extra), extra + 1
    return [chars[b] for b in printable] + [chars[b] for b in range(256) if b not in printable]


def bpe_merges(n_merges: int) -> list[tuple[str, str]]:
    """Learn up to ``n_merges`` BPE merges from a Zipf-weighted English word list."""
    return list(_learned_merges(n_merges))


@lru_cache(maxsize=8)
def _learned_merges(n_merges: int) -> tuple[tuple[str, str], ...]:
    # about a second for a few hundred merges: every model of a build (and every model
    # the speed probe writes) has the same vocabulary
    counts: dict[tuple[str, ...], int] = {}
    for rank, word in enumerate(dict.fromkeys(_WORDS)):
        weight = 40_000 // (rank + 200)  # gently Zipf: rarer words still get whole-word merges
        for form, w in (("Ġ" + word, weight), (word, weight // 4), ("Ġ" + word.title(), weight // 8)):
            counts[tuple(form)] = counts.get(tuple(form), 0) + w + 1
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        pairs: dict[tuple[str, str], int] = {}
        for syms, c in counts.items():
            for pair in zip(syms, syms[1:], strict=False):
                pairs[pair] = pairs.get(pair, 0) + c
        if not pairs:
            break
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        merges.append(best)
        counts = {_merge(syms, best): c for syms, c in counts.items()}
    return tuple(merges)


def _merge(syms: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out: list[str] = []
    i = 0
    while i < len(syms):
        if i + 1 < len(syms) and (syms[i], syms[i + 1]) == pair:
            out.append(syms[i] + syms[i + 1])
            i += 2
        else:
            out.append(syms[i])
            i += 1
    return tuple(out)


def vocabulary(spec: SyntheticSpec) -> tuple[list[str], list[int], list[str]]:
    """Byte-level BPE tokens, token types and merge strings: bytes, merged tokens, specials, padding."""
    import gguf  # lazy: ~0.2 s to import, only to build models

    tokens = byte_tokens()
    merges = bpe_merges(spec.n_merges)
    for a, b in merges:
        if a + b not in tokens[256:]:
            tokens.append(a + b)
    types = [int(gguf.TokenType.NORMAL)] * len(tokens)
    specials = TOKENIZERS[spec.tokenizer].specials
    tokens += specials
    types += [int(gguf.TokenType.CONTROL)] * len(specials)
    _pad(spec, tokens, types, "\u0120")  # "Ġ" is the byte-level BPE space
    return tokens, types, [f"{a} {b}" for a, b in merges]


def spm_vocabulary(spec: SyntheticSpec) -> tuple[list[str], list[int], list[float]]:
    """SentencePiece pieces, types and scores: ``<unk> <s> </s>``, 256 byte pieces, characters,
    the merged words (``▁`` for a leading space), added tokens, padding."""
    import gguf  # lazy: ~0.2 s to import, only to build models

    merges = [(a.replace("Ġ", "▁"), b.replace("Ġ", "▁")) for a, b in bpe_merges(spec.n_merges)]
    chars = sorted({c for a, b in merges for c in a + b})
    pieces = list(dict.fromkeys([*chars, *(a + b for a, b in merges)]))
    tokens = [*SPM_LEADING, *(f"<0x{b:02X}>" for b in range(256)), *pieces, *SPM_SPECIAL_TOKENS]
    T = gguf.TokenType
    types = [int(T.UNKNOWN), int(T.CONTROL), int(T.CONTROL)] + [int(T.BYTE)] * 256
    types += [int(T.NORMAL)] * len(pieces) + [int(T.CONTROL)] * len(SPM_SPECIAL_TOKENS)
    # SentencePiece merges the adjacent pair whose result scores highest: earlier merges first.
    scores = [0.0] * (len(SPM_LEADING) + 256) + [-float(i) for i in range(len(pieces))]
    scores += [0.0] * len(SPM_SPECIAL_TOKENS)
    _pad(spec, tokens, types, "▁")
    return tokens, types, scores + [-1e4] * (len(tokens) - len(scores))


def _pad(spec: SyntheticSpec, tokens: list[str], types: list[int], space: str) -> None:
    """Fill the vocabulary up to ``n_vocab`` with ``[PAD{i}]`` (unused) or visible ``pad{i}``."""
    import gguf  # lazy: ~0.2 s to import, only to build models

    pad = range(len(tokens), spec.n_vocab)
    if spec.visible_padding:
        tokens += [f"{space}pad{i}" for i in pad]
        types += [int(gguf.TokenType.NORMAL)] * len(pad)
    else:
        tokens += [f"[PAD{i}]" for i in pad]
        types += [int(gguf.TokenType.UNUSED)] * len(pad)
