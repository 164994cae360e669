"""Stop strings: the linear automaton against a brute-force reference, however the text arrives."""

from hypothesis import given, settings, strategies as st

from specdec.stops import StopStrings

ALPHABET = "ab\u00e9c"  # few letters: overlaps, borders and repeats are common
texts = st.text(alphabet=ALPHABET, max_size=40)
stop_lists = st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=8), min_size=0, max_size=4)


def reference(text: str, stops: list[str]) -> tuple[int | None, int]:
    """Slow and obvious: the first character at which some stop ends (the longest of those ending
    there wins); else the longest end of the text that is a proper prefix of a stop."""
    for end in range(1, len(text) + 1):
        ending = [len(s) for s in stops if text[:end].endswith(s)]
        if ending:
            return end - max(ending), 0
    return None, max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


@settings(max_examples=400, deadline=None)
@given(texts, stop_lists, st.lists(st.integers(0, 40), max_size=6))
def test_matches_reference_however_the_text_is_split(text, stops, cuts):
    """Fed in pieces (steps of a speculative generation), the answer is that of the whole text."""
    matcher = StopStrings(stops)
    for cut in sorted(c for c in cuts if c < len(text)):
        found = matcher.scan(text[:cut])
        assert found == reference(text[:cut], stops)
        if found[0] is not None:
            return
    assert matcher.scan(text) == reference(text, stops)


@settings(max_examples=300, deadline=None)
@given(texts, texts, texts, stop_lists)
def test_a_rewritten_end_is_rescanned(common, before, after, stops):
    """A decode may rewrite the text's last characters once more tokens arrive."""
    matcher = StopStrings(stops)
    first = matcher.scan(common + before)
    if first[0] is None:
        assert matcher.scan(common + after) == reference(common + after, stops)


@settings(max_examples=300, deadline=None)
@given(texts, stop_lists, st.lists(st.tuples(st.integers(0, 40), texts), min_size=1, max_size=6))
def test_rewrites_at_any_depth_are_rescanned(start, stops, edits):
    """Each scan keeps some prefix of the last text and appends new characters: checkpoints in the
    middle of the stack are rewound to, and every answer is the reference's."""
    matcher, text = StopStrings(stops), start
    found = matcher.scan(text)
    for keep, appended in edits:
        if found[0] is not None:
            return
        assert found == reference(text, stops)
        text = text[:keep] + appended
        found = matcher.scan(text)
    assert found == reference(text, stops)


def test_overlapping_stops_cut_where_the_first_one_ends():
    """'c' ends before 'abcd' does: token by token a plain decode stops at 'c', so must a step of many tokens."""
    assert StopStrings(["abcd", "c"]).scan("xabcd") == (3, 0)
    assert StopStrings(["bc", "abc"]).scan("xabc") == (1, 0)  # both end at 'c': the longer begins first


def test_a_huge_stop_string_costs_only_the_text():
    """The failure table grows only as far as the automaton's state: a 200,000-character stop
    matched against a short text builds a few entries, however long the stop is."""
    matcher = StopStrings(["q" * 200_000] * 4)
    assert matcher.scan("def f(x): qqq") == (None, 3)
    assert max(len(table) for table in matcher._failure) <= 4


class Distinct:
    """A tokenizer whose token i is the character chr(0x4E00 + i), counting its decodes and the ids they read."""

    def __init__(self):
        self.decodes = self.ids_read = 0

    def decode(self, ids, skip_special_tokens=True):
        self.decodes += 1
        self.ids_read += len(ids)
        return "".join(chr(0x4E00 + i) for i in ids)


def test_a_stop_spanning_many_tokens_cuts_them_with_few_decodes():
    """The tokens before a stop string that spans 399 tokens are found by bisection, not by one
    decode of the whole text per token it spans (400 decodes reading 240,000 ids); and each step
    decodes its last tokens only, not the whole text again (`text.GrowingText`: 20 steps of 50 would
    read 10,500 ids whole)."""
    from specdec.api import TextAssembler
    from specdec.engine import StepResult

    tokenizer = Distinct()
    tokens = list(range(1000))
    text = TextAssembler(tokenizer, [999], [tokenizer.decode(range(601, 1000))])
    for start in range(0, 1000, 50):  # 50 tokens a step
        text.add(StepResult(tokens[start : start + 50]))
    assert text.finish_reason == "stop" and text.text == tokenizer.decode(range(601)) and text.tokens == tokens[:601]
    # 20 steps (a decode each, 4 more where the fixed text grows), ~12 to find the cut
    assert tokenizer.decodes < 120, f"{tokenizer.decodes} decodes"
    assert tokenizer.ids_read < 15_000, f"{tokenizer.ids_read} ids read"  # read whole each step: 19,600
