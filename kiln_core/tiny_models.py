"""Tiny, deterministic Hugging Face models built locally: no hub downloads, byte-identical every time.

The demo, the tests and the benches need a student and a teacher that load through ``transformers``
exactly like real ones (``config.json``, ``tokenizer.json``, ``tokenizer_config.json`` with a chat
template, safetensors weights). They are built here from a fixed training text, a byte-level BPE
tokenizer trained with ``tokenizers``, and a seeded Qwen3-shaped causal LM.

The chat template is ChatML with ``{% generation %}`` blocks around each assistant turn's content,
``<|im_end|>`` and the newline after it, so the transformers assistant mask and Kiln's ChatML fallback
mark the same tokens. ``generation_blocks=False`` writes the same template without those blocks.

A family's own template (Gemma's, Llama 3's, Qwen3's thinking template) writes tokens ChatML does not have:
``ChatTokens`` adds them to the vocabulary after the BPE entries, as that family's tokenizer has them, and
``build_tiny_model(..., chat_template=..., chat_tokens=...)`` builds a model that speaks it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML_TEMPLATE_WITH_GENERATION = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{% generation %}{{- message['content'] + '<|im_end|>\\n' -}}{% endgeneration %}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

CHATML_TEMPLATE_PLAIN = CHATML_TEMPLATE_WITH_GENERATION.replace("{% generation %}", "").replace(
    "{% endgeneration %}", ""
)

# The text the tokenizer is trained on. Changing it changes every tiny model's identity.
_TRAINING_TEXT = """
You are a helpful assistant. Answer with JSON only when asked. List files under src/.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
{"directory":"src","recursive":true} src/lib.rs src/main.rs README.md tests/ docs/
def add(a, b): return a + b. print("hello world"). for i in range(10): total += i
Distillation trains a small student to match a large teacher on the same tokens.
What is two plus two? Two plus two is four. What is the capital of France? Paris.
Summarize the text in one sentence. Translate to French: good morning -> bonjour.
Tool call: read_file(path="src/main.rs") -> fn main() { println!("hi"); }
error: file not found. warning: deprecated API. ok. yes. no. 0 1 2 3 4 5 6 7 8 9
"""


@dataclass(frozen=True)
class ChatTokens:
    """The tokens a family's chat template writes, added to the tiny vocabulary the way its tokenizer has them.

    Attributes:
        special: Special added tokens, appended after the BPE vocabulary in this order (never split by BPE,
            dropped when decoding with ``skip_special_tokens``): Gemma's ``<start_of_turn>``, Llama 3's
            ``<|eot_id|>``.
        added: Ordinary added tokens appended after them (never split, kept when decoding): Qwen3's ``<think>``.
        bos_token: The tokenizer's BOS, one of ``special``. Encoding *with* special tokens prepends it, as
            Gemma's and Llama 3's tokenizers do; None: no BOS (ChatML's tiny tokenizer).
        eos_token: The tokenizer's EOS.
    """

    special: tuple[str, ...] = ()
    added: tuple[str, ...] = ()
    bos_token: str | None = None
    eos_token: str = "<|im_end|>"


def build_tiny_tokenizer(out_dir: str | Path, *, vocab_size: int = 384, generation_blocks: bool = True,
                         chat_tokens: ChatTokens | None = None) -> Path:
    """Train a byte-level BPE tokenizer on a fixed text and save it as a fast HF tokenizer.

    Args:
        out_dir: Directory to write ``tokenizer.json`` and ``tokenizer_config.json`` into.
        vocab_size: Target BPE vocabulary size, special tokens included.
        generation_blocks: Whether the chat template carries ``{% generation %}`` blocks.
        chat_tokens: Tokens a family's template needs, appended after the trained vocabulary (so the
            ids of every trained token stay what they are without them); None writes exactly the ChatML
            tokenizer.

    Returns:
        The output directory.

    Example:
        >>> build_tiny_tokenizer("/tmp/tok")  # doctest: +SKIP
        >>> build_tiny_tokenizer("/tmp/gemma-tok", chat_tokens=ChatTokens(
        ...     special=("<bos>", "<start_of_turn>", "<end_of_turn>"), bos_token="<bos>"))  # doctest: +SKIP
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [line for line in _TRAINING_TEXT.splitlines() if line.strip()]
    tokenizer.train_from_iterator(lines * 4, trainer=trainer)
    chat_tokens = chat_tokens or ChatTokens()
    _add_chat_tokens(tokenizer, chat_tokens)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=chat_tokens.eos_token,
        pad_token="<|endoftext|>",
        bos_token=chat_tokens.bos_token,
        unk_token=None,
    )
    fast.chat_template = CHATML_TEMPLATE_WITH_GENERATION if generation_blocks else CHATML_TEMPLATE_PLAIN
    fast.save_pretrained(str(out))
    return out


def _add_chat_tokens(tokenizer, chat_tokens: ChatTokens) -> None:
    """Append a family's tokens to a trained tokenizer; a BOS is prepended when encoding with special tokens."""
    from tokenizers import AddedToken, processors

    known = set(SPECIAL_TOKENS)
    special = [AddedToken(text, special=True, normalized=False) for text in chat_tokens.special if text not in known]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens([AddedToken(text, special=False, normalized=False) for text in chat_tokens.added])
    if chat_tokens.bos_token is not None:
        bos_id = tokenizer.token_to_id(chat_tokens.bos_token)
        if bos_id is None:
            raise ValueError(f"bos_token {chat_tokens.bos_token!r} is not one of the special tokens")
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{chat_tokens.bos_token} $A", pair=f"{chat_tokens.bos_token} $A {chat_tokens.bos_token} $B",
            special_tokens=[(chat_tokens.bos_token, bos_id)])


# The architectures a tiny model can take: transformers' config class, causal-LM class and what the family needs
# beyond the shared shape. The post-processing values are set away from their defaults where the default would do
# nothing (Granite's logits_scaling 1.0, Gemma 3's soft cap off), and the soft cap sits where a tiny model's logits
# (a few units) reach it, as a real Gemma's (tens) reach its 30: the tiny model exercises what a real one does.
TINY_ARCHITECTURES: dict[str, tuple[str, str, dict]] = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": "auto"}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"head_dim": "auto", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": "auto"}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": "auto", "final_logit_softcapping": 5.0}),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": "auto", "final_logit_softcapping": 5.0}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {"logit_scale": 0.0625}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"logits_scaling": 8.0}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
}


def build_tiny_model(
    out_dir: str | Path,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 400,
    tokenizer_vocab_size: int = 384,
    generation_blocks: bool = True,
    max_position_embeddings: int = 2048,
    architecture: str = "qwen3",
    tie_word_embeddings: bool | None = None,
    chat_template: str | None = None,
    chat_tokens: ChatTokens | None = None,
    init_std: float = 0.2,
) -> Path:
    """Build a causal LM with seeded random weights (Qwen3-shaped unless ``architecture`` says otherwise), plus its
    tokenizer.

    ``vocab_size`` (the logit width) may exceed the tokenizer's entry count, as in real Qwen models.

    Args:
        out_dir: Directory that becomes a loadable model dir (``AutoModelForCausalLM.from_pretrained``).
        seed: Seed for the weight initialisation; the same seed gives byte-identical safetensors.
        hidden_size: Model width.
        num_layers: Decoder layers.
        num_heads: Attention heads.
        num_kv_heads: Key/value heads.
        intermediate_size: MLP width.
        vocab_size: Embedding and LM-head rows.
        tokenizer_vocab_size: BPE vocabulary size of the tokenizer.
        generation_blocks: Whether the chat template carries ``{% generation %}`` blocks.
        max_position_embeddings: Context cap written to the config.
        architecture: A key of ``TINY_ARCHITECTURES`` (``qwen3``, ``gemma2``, ``phi3``, ...).
        tie_word_embeddings: Share the LM head with the embeddings; the family's default when None (Qwen3: untied).
        chat_template: Replaces the tokenizer's ChatML template (a family's own, e.g. Gemma's).
        chat_tokens: The tokens that template writes, added to the tokenizer (``build_tiny_tokenizer``).
        init_std: Standard deviation of every matrix's normal init (0.2 makes tiny teachers and students disagree
            visibly; a deep model at real width wants transformers' own 0.02).

    Returns:
        The output directory.

    Example:
        >>> build_tiny_model("/tmp/student", seed=1)  # doctest: +SKIP
        >>> build_tiny_model("/tmp/gemma2", architecture="gemma2")  # doctest: +SKIP
    """
    import torch
    import transformers

    if architecture not in TINY_ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {architecture!r}; one of {sorted(TINY_ARCHITECTURES)}")
    config_name, model_name, extra = TINY_ARCHITECTURES[architecture]
    out = Path(out_dir)
    build_tiny_tokenizer(out, vocab_size=tokenizer_vocab_size, generation_blocks=generation_blocks,
                         chat_tokens=chat_tokens)
    if chat_template is not None:
        _replace_chat_template(out, chat_template)
    family = {key: (hidden_size // num_heads if value == "auto" else value) for key, value in extra.items()}
    if tie_word_embeddings is None:
        tie_word_embeddings = False if architecture == "qwen3" else None
    if tie_word_embeddings is not None:
        family["tie_word_embeddings"] = tie_word_embeddings
    config = getattr(transformers, config_name)(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=None,
        eos_token_id=2,
        pad_token_id=0,
        **family,
    )
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = getattr(transformers, model_name)(config)
        # Default init gives near-uniform logits; a larger scale makes teachers and students disagree
        # in ways the tests can see.
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if parameter.dim() == 2:
                    parameter.normal_(0.0, init_std)
        model.save_pretrained(str(out))
    finally:
        torch.random.set_rng_state(generator_state)
    _drop_volatile_config_keys(out / "config.json")
    return out


def _replace_chat_template(model_dir: Path, template: str) -> None:
    """Write ``template`` where the saved tokenizer keeps its chat template."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.exists():
        jinja.write_text(template, encoding="utf-8")
        return
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["chat_template"] = template
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _drop_volatile_config_keys(config_path: Path) -> None:
    """Remove keys that vary with the installed library version, so identities stay stable."""
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config.pop("transformers_version", None)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
