"""Tiny random encoder checkpoints (BERT and XLM-RoBERTa), saved by HF transformers exactly as
`save_pretrained` writes them, for tests that compare ember's encoder models against
transformers and sentence-transformers on the same files.

`save_bert` / `save_xlm_roberta` write into a directory either an embedding model (`head=None`:
`BertModel` / `XLMRobertaModel` plus the sentence-transformers files, so that
`SentenceTransformer(path)` loads it as Transformer -> Pooling -> Normalize) or a sequence
classifier (`head="classify"`: `...ForSequenceClassification`, which `CrossEncoder(path)` loads).
The weights are seeded random float32, drawn with std 0.1 (initializer_range; 0.02 would leave the
attention almost uniform); LayerNorm weights are scaled by random factors around 1 and every bias is
random, so that mishandling a LayerNorm or a bias changes the outputs. The
tokenizers are built locally: a WordPiece vocabulary for BERT, and a small Unigram model trained on
`_CORPUS` for XLM-R. `TEXTS` and `PAIRS` are inputs for the tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from torch import nn
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    BertTokenizerFast,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    XLMRobertaConfig,
    XLMRobertaForSequenceClassification,
    XLMRobertaModel,
    XLMRobertaTokenizerFast,
)

TEXTS: list[str] = [
    "Yes.",
    "Hello world!",
    "The cat sat on the mat.",
    "How many people live in Berlin?",
    "A quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France, and it is known for its art, food and long history.",
    "Machine learning models turn text into vectors, which can then be compared to find the documents "
    "that answer a question.",
    "In 2023 the city had about 3 million people, and many of them went to work by train or bus.",
]

PAIRS: list[tuple[str, str]] = [
    ("How many people live in Berlin?", "Berlin had a population of about 3.7 million people in 2023."),
    ("What is the capital of France?", "Paris is the capital of France."),
    ("what do cats eat", "Cats eat fish, meat and dry food every day."),
    ("Who wrote the book?", "The weather today is sunny and warm."),
]

_MORE_SENTENCES = """\
The dog and the cat play in the garden while the sun is warm.
Many people in the city read a book on the train to work every morning.
What is the weather like in Paris today? It is cold and it may rain later.
A model reads the text of a question and finds the best answer in the documents.
The history of the world is long, and the people who wrote it are many.
Who lives in the old house by the river? A man, his wife and their two children.
She went to the market to buy bread, fish, fruit, meat and some fresh vegetables.
Learning a new language takes time, but every day of practice helps.
Berlin and Paris are large cities with museums, parks, art and good food.
The quick answer is yes, but the long answer is more interesting.
The brown dog jumps over the fence and runs into the garden.
A lazy cat sleeps on the mat all day and eats fish at night.
The fox is quick, the dog is lazy, and the cat sat on the mat.
Search engines compare the vectors of a query and of the documents to find the best match.
Text is split into tokens, and a model turns the tokens into vectors.
Which documents answer the question? The model can find them and compare them.
Machine learning is known for turning data into models that can answer questions.
France is a country in Europe, and its capital is Paris.
Germany is a country in Europe, and its capital is Berlin.
How many people went to work by bus, by train or by bike this week?
In 2020, 2021, 2022 and 2023 the population of the city grew by about a million people.
Every day of the week the train and the bus are full of people who go to work.
They live in a small house and eat dry food when the weather is cold.
The book about the history of France was written by a man from Paris.
Hello, how are you today? I am fine, thank you, and how is the weather where you live?
What do people eat for breakfast? Bread, eggs, fruit and coffee.
The capital of a country is often its largest city, but not always.
Cats and dogs are the most popular animals that people keep at home.
The documents that answer a question are compared with the query to find the best one.
Today the weather is sunny and warm, and many people are in the parks.
Some children walk to school, others take the bus or ride a bike with their friends.
The river runs through the middle of the city and under many old bridges.
A good question often has a short answer and a long explanation.
The museum shows paintings, old maps and photographs from the last hundred years.
Our team wrote three papers this year about search, ranking and sentence embeddings.
The train was late again, so she walked home in the rain without an umbrella.
Please read the document carefully and answer every question at the end.
He bought a new phone, but the old one still works better in cold weather.
Rivers, mountains and forests cover most of the northern part of the country.
We compared five models and found that the smallest one was almost as good.
""".splitlines()

_CORPUS: list[str] = [*TEXTS, *(text for pair in PAIRS for text in pair), *_MORE_SENTENCES]

_SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
              max_position_embeddings=128, initializer_range=0.1)

_LABEL_NAMES = {2: ["negative", "positive"], 3: ["negative", "neutral", "positive"]}

_BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]

_BERT_WORDS = """
the a an of and to in is it that for on with as at by from be was are were this or not but have has had
what who how which when where why can do does did will would many much more most some all any each every
people person man woman child children live lives lived city cities capital country world hello yes no
cat cats dog dogs fox quick brown lazy jump jumps over sat mat paris france berlin known its art food
long history machine learning model models turn text into vector vectors then compared find documents
document answer question share topic query population about million eat fish meat dry wrote book books
weather today sunny warm cold rain sun day days week year time went work train bus bike good bad new old
big small first last one two three four five ten hundred they them their he she his her we you i me my
our your there here very also just only than so if up out
""".split()

_BERT_PIECES = ["##s", "##es", "##ed", "##ing", "##er", "##est", "##ly", "##tion", "##al", "##ment", "##ness"]


def save_bert(path: Path, *, head: str | None = None, num_labels: int = 1, pooling: str = "mean",
              normalize: bool = True, seed: int = 0) -> Path:
    """A tiny random BERT in `path`: a `BertModel` with the sentence-transformers files
    (`head=None`) or a `BertForSequenceClassification` with `num_labels` labels (`head="classify"`)."""
    tokenizer = _bert_tokenizer()
    config = BertConfig(vocab_size=len(tokenizer), type_vocab_size=2, hidden_act="gelu",
                        pad_token_id=tokenizer.pad_token_id, **_SIZES)
    return _save(Path(path), config, tokenizer, BertModel, BertForSequenceClassification, head=head,
                 num_labels=num_labels, pooling=pooling, normalize=normalize, seed=seed,
                 max_seq_length=config.max_position_embeddings)


def save_xlm_roberta(path: Path, *, head: str | None = None, num_labels: int = 1, pooling: str = "cls",
                     normalize: bool = True, seed: int = 0) -> Path:
    """A tiny random XLM-RoBERTa in `path`: an `XLMRobertaModel` with the sentence-transformers files
    (`head=None`) or an `XLMRobertaForSequenceClassification` with `num_labels` labels
    (`head="classify"`). Positions start at pad_token_id + 1, so at most 126 tokens fit."""
    tokenizer = _xlm_roberta_tokenizer()
    config = XLMRobertaConfig(vocab_size=len(tokenizer), type_vocab_size=1, hidden_act="gelu",
                              pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id, **_SIZES)
    return _save(Path(path), config, tokenizer, XLMRobertaModel, XLMRobertaForSequenceClassification,
                 head=head, num_labels=num_labels, pooling=pooling, normalize=normalize, seed=seed,
                 max_seq_length=config.max_position_embeddings - config.pad_token_id - 1)


def _bert_tokenizer() -> PreTrainedTokenizerBase:
    tokens = [*_BERT_SPECIALS, *".,!?;:'\"-()/", *"0123456789", *"abcdefghijklmnopqrstuvwxyz",
              *(f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz0123456789"), *_BERT_PIECES, *_BERT_WORDS]
    vocab = {token: i for i, token in enumerate(dict.fromkeys(tokens))}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                                lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0", pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    return BertTokenizerFast(tokenizer_object=tok, do_lower_case=True, model_max_length=_SIZES["max_position_embeddings"])


def _xlm_roberta_tokenizer() -> PreTrainedTokenizerBase:
    # the pieces transformers' XLMRobertaTokenizer rebuilds around the vocab when it loads tokenizer.json
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")])
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
                                      unk_token="<unk>", show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    # The trained scores differ between runs in their last bits, and the trainer appends the characters
    # it pruned at the end, with scores 1e-4 apart, in hash order. Rounded, and with that last run of
    # scores dealt out in piece order, the vocab (so tokenizer.json) is the same every time.
    trained = [(piece, round(score, 6)) for piece, score in json.loads(tok.to_str())["model"]["vocab"]]
    specials, pieces = trained[:4], sorted(trained[4:], key=lambda p: (-p[1], p[0]))
    tail = len(pieces) - 1
    while tail > 0 and pieces[tail - 1][1] - pieces[tail][1] < 1.5e-4:
        tail -= 1
    dealt = zip(sorted(piece for piece, _ in pieces[tail:]), (score for _, score in pieces[tail:]))
    vocab = specials + sorted(pieces[:tail] + list(dealt), key=lambda p: (-p[1], p[0]))
    tok.model = models.Unigram(vocab, unk_id=3, byte_fallback=False)
    tok.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True)])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", tok.token_to_id("<s>")), ("</s>", tok.token_to_id("</s>"))])
    assert [tok.token_to_id(t) for t in ("<s>", "<pad>", "</s>", "<unk>")] == [0, 1, 2, 3]
    assert tok.token_to_id("<mask>") == tok.get_vocab_size() - 1
    return XLMRobertaTokenizerFast(tokenizer_object=tok, model_max_length=_SIZES["max_position_embeddings"] - 2)


def _save(path: Path, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase,
          base_cls: type[PreTrainedModel], classify_cls: type[PreTrainedModel], *, head: str | None,
          num_labels: int, pooling: str, normalize: bool, seed: int, max_seq_length: int) -> Path:
    if head not in (None, "classify"):
        raise ValueError(f"head must be None or 'classify', not {head!r}")
    if head == "classify":
        names = _LABEL_NAMES.get(num_labels, [f"LABEL_{i}" for i in range(num_labels)])
        config.num_labels = num_labels
        config.id2label = dict(enumerate(names))
        config.label2id = {name: i for i, name in enumerate(names)}
    path.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = (classify_cls if head == "classify" else base_cls)(config).to(torch.float32).eval()
        _randomize_norms_and_biases(model)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    if head is None:
        _save_sentence_transformer(path, pooling, normalize, max_seq_length)
    return path


def _randomize_norms_and_biases(model: nn.Module) -> None:
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.mul_(torch.empty_like(module.weight).uniform_(0.5, 1.5))
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)


def _save_sentence_transformer(path: Path, pooling: str, normalize: bool, max_seq_length: int) -> None:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    transformer = Transformer(str(path), max_seq_length=max_seq_length)
    modules: list[nn.Module] = [transformer, Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling)]
    if normalize:
        modules.append(Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(path), create_model_card=False)
