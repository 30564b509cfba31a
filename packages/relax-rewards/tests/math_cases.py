r"""The labelled math set: (response, label, correct?) — every form the ``math`` reward must handle.

Responses are whole model outputs (so extraction is exercised too); labels are what datasets store.
``correct`` is the mathematical truth we decided by hand, not what any grader says. Built from
small tables so each form has equal and unequal pairs; ``ADVERSARIAL`` holds the nasty ones.
"""

B = r"The answer is $\boxed{%s}$."


def _boxed(pairs):
    return [(B % pred, label, ok) for pred, label, ok in pairs]


INTEGERS = _boxed(
    [
        ("42", "42", True),
        ("42", "43", False),
        ("-7", "-7", True),
        ("-7", "7", False),
        ("0", "0", True),
        ("+5", "5", True),
        ("007", "7", True),
        ("100", "1000", False),
        ("12", "12.0", True),
        ("12", "12.5", False),
        ("1000000", "1000000", True),
        ("999999", "1000000", False),
        ("-0", "0", True),
        ("2", "-2", False),
        ("17", "71", False),
    ]
)
DECIMALS = _boxed(
    [
        ("0.5", "0.5", True),
        ("0.50", "0.5", True),
        (".5", "0.5", True),
        ("0.5", "0.05", False),
        ("3.14", "3.14", True),
        ("3.14", "3.15", False),
        ("-2.75", "-2.75", True),
        ("-2.75", "2.75", False),
        ("1.0", "1", True),
        ("2.000", "2", True),
        ("0.333", "0.3333", False),
        ("12.5", "25/2", True),
        ("0.125", r"\frac{1}{8}", True),
        ("0.2", r"\frac{1}{4}", False),
        ("1.5", "3/2", True),
    ]
)
FRACTIONS = _boxed(
    [
        (r"\frac{1}{2}", "1/2", True),
        (r"\frac{1}{2}", "2/4", True),
        (r"\frac{1}{2}", r"\frac{1}{3}", False),
        (r"\dfrac{3}{4}", r"\frac{3}{4}", True),
        (r"\tfrac{3}{4}", "0.75", True),
        (r"\frac34", "3/4", True),
        (r"-\frac{2}{3}", r"\frac{-2}{3}", True),
        (r"-\frac{2}{3}", r"\frac{2}{3}", False),
        (r"\frac{10}{4}", r"\frac{5}{2}", True),
        ("7/3", r"2\frac{1}{3}", True),
        (r"\frac{22}{7}", r"\pi", False),
        (r"\frac{1}{3}", "0.33", False),
        ("5/10", "0.5", True),
        (r"\frac{a}{b}", r"\frac{a}{b}", True),
        (r"\frac{x+1}{2}", r"\frac{x}{2}+\frac{1}{2}", True),
        (r"\frac{x+1}{2}", r"\frac{x+2}{2}", False),
        (r"\frac{6}{8}", r"\frac{3}{4}", True),
        (r"\frac{1}{-2}", "-0.5", True),
    ]
)
PERCENT = _boxed(
    [
        (r"50\%", "50", True),
        ("50%", r"50\%", True),
        (r"25\%", "0.25", True),
        (r"25\%", "25", True),
        (r"30\%", "0.25", False),
        (r"12.5\%", "12.5", True),
        (r"50 \%", "50", True),
        (r"100\%", "1", True),
        (r"40\%", "4", False),
        ("7 percent", "7", True),
    ]
)
SCIENTIFIC = _boxed(
    [
        ("1e3", "1000", True),
        ("1E3", "1000", True),
        ("2.5e-3", "0.0025", True),
        ("2.5e-3", "0.025", False),
        (r"3\times 10^{4}", "30000", True),
        (r"3 \times 10^4", "30000", True),
        (r"6.02\times10^{23}", "6.02e23", True),
        (r"1.6 \times 10^{-19}", "1.6e-19", True),
        (r"1.6 \times 10^{-19}", "1.6e-18", False),
        (r"10^{3}", "1000", True),
        ("10^6", "1000000", True),
        ("2^{10}", "1024", True),
        ("2^{10}", "1000", False),
    ]
)
THOUSANDS = _boxed(
    [
        ("1,000", "1000", True),
        ("1{,}000", "1000", True),
        ("12,345,678", "12345678", True),
        ("1,234.5", "1234.5", True),
        ("1,000", "100", False),
        (r"1\,000", "1000", True),
        ("10,000", "10000.0", True),
        ("1,001", "1000", False),
    ]
)
LATEX = _boxed(
    [
        (r"\sqrt{2}", r"\sqrt{2}", True),
        (r"\sqrt2", r"\sqrt{2}", True),
        (r"2\sqrt{2}", r"\sqrt{8}", True),
        (r"\sqrt{8}", r"2\sqrt{3}", False),
        (r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}", True),
        (r"\sqrt{12}", r"2\sqrt{3}", True),
        (r"3\sqrt{3}", r"\sqrt{27}", True),
        (r"\sqrt[3]{8}", "2", True),
        (r"\sqrt[3]{27}", "9", False),
        (r"\pi", r"\pi", True),
        (r"2\pi", r"\pi \cdot 2", True),
        (r"\frac{\pi}{2}", r"\pi/2", True),
        (r"\frac{\pi}{3}", r"\frac{\pi}{6}", False),
        (r"4\pi", "4 \\pi", True),
        (r"\pi r^2", r"r^2\pi", True),
        ("x^2", "x^{2}", True),
        ("x^2", "x^3", False),
        (r"e^{2}", r"e^2", True),
        (r"\left(\frac{1}{2}\right)^2", r"\frac{1}{4}", True),
        (r"\left(2\right)", "2", True),
        (r"\displaystyle \frac{1}{2}", "0.5", True),
        (r"\dfrac{\sqrt{3}}{2}", r"\frac{\sqrt3}{2}", True),
        (r"2^{-1}", r"\frac12", True),
        (r"\sqrt{2}+\sqrt{2}", r"2\sqrt{2}", True),
        (r"5\sqrt{2}", r"5\sqrt{3}", False),
        (r"\frac{1+\sqrt{5}}{2}", r"\frac{\sqrt{5}+1}{2}", True),
        (r"\frac{1-\sqrt{5}}{2}", r"\frac{1+\sqrt{5}}{2}", False),
        (r"3!", "6", True),
        (r"\binom{5}{2}", "10", True),
        (r"10 \div 2", "5", True),
    ]
)
SYMBOLIC = _boxed(
    [
        ("x^2+2x+1", "(x+1)^2", True),
        ("x^2+2x+1", "(x-1)^2", False),
        ("2x+3", "3+2x", True),
        ("2(x+1)", "2x+2", True),
        ("a+b", "b+a", True),
        ("a-b", "b-a", False),
        ("x y", "yx", True),
        ("(x-1)(x+1)", "x^2-1", True),
        (r"\frac{x^2-1}{x-1}", "x+1", True),
        ("3x", "x3", True),
        ("2a^2b", "2ba^2", True),
        ("x^3-x", "x(x-1)(x+1)", True),
        ("n(n+1)/2", r"\frac{n^2+n}{2}", True),
        ("n(n+1)/2", r"\frac{n^2-n}{2}", False),
        (r"\sin^2 x + \cos^2 x", "1", True),
        (r"2\sin(x)\cos(x)", r"\sin(2x)", True),
        (r"\log(8)", r"3\log(2)", True),
        (r"\tan^2 x + 1", r"\frac{1}{\cos^2 x}", True),
        (r"\sin^2 x", r"\cos^2 x", False),
        (r"\ln(e^2)", "2", True),
        ("4x^2-9", "(2x-3)(2x+3)", True),
        ("k^2", "k^2+0", True),
        ("5-2t", "-2t+5", True),
        ("t+1", "t-1", False),
    ]
)
INTERVALS = _boxed(
    [
        ("(1,2]", "(1,2]", True),
        ("(1,2]", "[1,2)", False),
        ("(1, 2]", "(1,2]", True),
        (r"[0,\infty)", r"[0, \infty)", True),
        (r"(-\infty, 3)", r"(-\infty,3)", True),
        (r"(-\infty,3]", r"(-\infty,3)", False),
        (r"(-\infty,3)\cup(4,5)", r"(-\infty, 3) \cup (4, 5)", True),
        (r"(-\infty,3)\cup(4,5)", r"(-\infty,3)\cup(4,6)", False),
        (r"\left[\frac{1}{2}, 2\right]", "[0.5, 2]", True),
        (r"[0.5, 2]", "[0.5, 3]", False),
        (r"(0,\frac{1}{2}]", "(0, 1/2]", True),
        ("[-1,1]", "[-1, 1]", True),
        ("[-1,1]", "(-1,1)", False),
        (r"(2, \infty)", r"(2,\infty)", True),
        (r"(4,5)\cup(-\infty,3)", r"(-\infty,3)\cup(4,5)", True),
    ]
)
SETS_TUPLES = _boxed(
    [
        ("(1,2)", "(1,2)", True),
        ("(1,2)", "(2,1)", False),
        ("(1, 2)", "(1,2)", True),
        (r"\{1,2,3\}", r"\{3,1,2\}", True),
        (r"\{1,2\}", r"\{1,3\}", False),
        ("1, 2, 3", "3, 2, 1", True),
        ("1,2", "1,2,3", False),
        (r"(\frac{1}{2}, 3)", "(0.5, 3)", True),
        ("(3, -4)", "(3,-4)", True),
        ("(3, -4)", "(-4, 3)", False),
        (r"\left(2, 5\right)", "(2,5)", True),
        (r"(1,2,3)", "(1,2,3)", True),
        ("(0,0)", "(0,1)", False),
        (r"\{-2, 2\}", r"\{2, -2\}", True),
        ("x=1, x=2", "1, 2", True),
        (r"2, -2", r"\pm 2", True),
        (r"(a, b)", "(a,b)", True),
    ]
)
EQUATIONS = _boxed(
    [
        ("x=3", "3", True),
        ("x = 3", "x=3", True),
        ("x=3", "4", False),
        ("y=2x+1", "2x+1", True),
        ("y=2x+1", "y = 1 + 2x", True),
        ("y=2x+1", "y=2x-1", False),
        ("x^2-1=0", "x^2=1", True),
        ("a = 5", "5", True),
        ("n=12", "12", True),
        ("k = -1", "-1", True),
        ("x+y=1", "y=1-x", True),
        ("x+y=1", "x-y=1", False),
    ]
)
UNITS_TEXT = _boxed(
    [
        (r"5 \text{ cm}", "5", True),
        (r"5\text{cm}", "5", True),
        (r"12 \text{ meters}", "12", True),
        (r"90^\circ", "90", True),
        (r"90^{\circ}", "90", True),
        (r"45°", "45", True),
        (r"\$10", "10", True),
        (r"10 \text{ dollars}", "10", True),
        (r"\text{12 apples}", "12", True),
        (r"12\text{ m}^2", "12", True),
        (r"\text{B}", "B", True),
        (r"\textbf{7}", "7", True),
        (r"\mathrm{7}", "7", True),
        (r"5 \text{ cm}", "6", False),
        ("3 hours", "3", True),
        ("3 hours", "4", False),
        (r"\text{yes}", "yes", True),
        (r"\text{no}", "yes", False),
        (r"20 \mbox{ km}", "20", True),
        (r"\$1{,}200", "1200", True),
    ]
)
EXTRACTION = [
    # boxed inside text, several boxes, the Answer: line, last number
    (r"First I guessed \boxed{3}, but correcting: \boxed{4}.", "4", True),
    (r"First I guessed \boxed{3}, but correcting: \boxed{4}.", "3", False),
    (r"The result \boxed{\frac{\sqrt{3}}{2}} follows.", r"\frac{\sqrt3}{2}", True),
    (r"\boxed{\text{the answer is } 12}", "12", True),
    (r"So $x = \boxed{5}$", "5", True),
    (r"\boxed{x = 5}", "5", True),
    (r"\fbox{9}", "9", True),
    (r"\boxed 7", "7", True),
    ("Work work.\nAnswer: 17", "17", True),
    ("Work work.\nAnswer: 17", "18", False),
    ("**Final Answer:** 42", "42", True),
    ("Answer: 1\nActually\nAnswer: 2", "2", True),
    ("Answer: 1\nActually\nAnswer: 2", "1", False),
    (r"Answer: $\frac{1}{2}$", "0.5", True),
    ("we get 3 + 4 = 7", "7", True),
    ("we get 3 + 4 = 7", "3", False),
    ("The total is 1,234 dollars.", "1234", True),
    ("no number at all", "0", False),
    ("", "1", False),
    (r"<think>maybe 5</think> so \boxed{6}", "6", True),
    (r"\boxed{\{1,2\}}", r"\{1,2\}", True),
    (r"\boxed{(1,2]}", "(1,2]", True),
    (r"\[ \boxed{\dfrac{9}{4}} \]", "2.25", True),
    (r"The answer: $\boxed{-\infty}$", r"-\infty", True),
    (r"The final answer is \boxed{12}. I hope it is correct.", "12", True),
    (r"$\boxed{\begin{pmatrix} 1 \\ 2 \end{pmatrix}}$", r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", True),
    (r"$\boxed{\textbf{(C)}\ 12}$", "12", True),
    ("The answer is 12 cm.", "12", True),
    ("It takes 2.5 hours.", "2.5", True),
    (r"x = \boxed{\frac{-1}{2}}", "-0.5", True),
]
ADVERSARIAL = [
    (r"\boxed{}", "0", False),
    (r"\boxed{ }", "0", False),
    (r"\boxed{}", "", False),
    (r"\boxed{5} and then a broken \boxed{6", "5", True),
    (r"\boxed{\frac{1}{2}", "0.5", False),  # unterminated: no complete box, no number extracted as 1/2
    (r"\boxed{2^{2^{2^{100}}}}", "4", False),
    (r"\boxed{9^{9^{9^{9}}}}", "1", False),
    (r"\boxed{10^{100}}", "1" + "0" * 100, True),
    (r"\boxed{10^{100}}", "1" + "0" * 99, False),
    (r"\boxed{123456789012345678901234567890}", "123456789012345678901234567890", True),
    (r"\boxed{123456789012345678901234567890}", "123456789012345678901234567891", False),
    (r"\boxed{100000000000000000001}", "100000000000000000000", False),
    (r"\boxed{1e400}", "1", False),
    (r"\boxed{200!}", "1", False),
    (r"\boxed{\frac{1}{0}}", "0", False),
    (r"\boxed{\frac{}{}}", "1", False),
    (r"\boxed{\sqrt{}}", "0", False),
    (r"\boxed{((((1))))}", "1", True),
    (r"\boxed{\left(1\right.}", "2", False),
    (r"\boxed{__import__('os').system('true')}", "0", False),
    (r"\boxed{\text{\boxed{7}}}", "7", True),
    (r"\boxed{\boxed{8}}", "8", True),
    (r"\boxed{1}\boxed{2}\boxed{3}", "3", True),
    (r"I am not sure. Maybe \boxed{3} or \boxed{4}.", "3", False),
    ("Answer:", "1", False),
    ("Answer: \n", "0", False),
    (r"\boxed{" + "1" * 500 + "}", "1" * 500, True),
    (r"\boxed{" + "1" * 500 + "}", "1" * 499, False),
    ("1" * 5000, "1", False),
    (r"\boxed{x^{1000000}}", "x", False),
    (r"\boxed{\sin(10^{10})}", "0", False),
    (r"\boxed{\infty}", r"\infty", True),
    (r"\boxed{\infty}", r"-\infty", False),
    (r"\boxed{0.1+0.2}", "0.3", True),
    (r"\boxed{1/3}", "0.3333333333", True),
    (r"\boxed{\frac{1}{3}}", r"0.\overline{3}", True),
    (r"\boxed{}}}}{{{", "1", False),
    (r"\boxed{\frac{1}{2}}}", "0.5", True),
    ("$$$$", "0", False),
    (r"\boxed{-}", "0", False),
    (r"\boxed{3.}", "3", True),
    (r"\boxed{3,}", "3", True),
    (r"\boxed{\pi}", "3.14159265", True),
    (r"\boxed{\pi}", "3.14", False),
    (r"\boxed{3}", r"\{3\}", True),
    (r"\boxed{x}", "y", False),
    (r"\boxed{\emptyset}", r"\varnothing", True),
    (r"\boxed{5}" + " filler" * 2000, "5", True),
]

MORE = _boxed(
    [
        (r"0.1\overline{6}", r"\frac{1}{6}", True),
        (r"0.\overline{9}", "1", True),
        (r"0.\overline{3}", "0.3", False),
        (r"2\frac{1}{2}", "2.5", True),
        (r"3\frac{3}{4}", r"\frac{15}{4}", True),
        (r"1\frac{1}{2}", "1", False),
        (r"1 \pm \sqrt{2}", r"1+\sqrt{2}, 1-\sqrt{2}", True),
        (r"\pm 3", "3, -3", True),
        (r"\pm 3", "3", False),
        (r"\sqrt{x^2}", "|x|", True),
        (r"\sqrt{x^2}", "x", False),
        (r"\frac{1}{\sqrt{3}}", r"\frac{\sqrt{3}}{3}", True),
        (r"\frac{\pi}{4}", "0.785398", True),
        (r"\frac{\pi}{4}", "0.78", False),
        (r"e", r"\exp(1)", True),
        (r"\sqrt{3}", "1.732", False),
        (r"-\sqrt{3}", r"\sqrt{3}", False),
        ("2^{100}", "1267650600228229401496703205376", True),
        ("2^{100}", "1267650600228229401496703205377", False),
        ("0.000001", "1e-6", True),
        ("0.000001", "1e-7", False),
        (r"\$5.50", "5.5", True),
        ("5.50", "5.05", False),
        (r"(\sqrt{2}, \pi)", r"(\sqrt2, \pi)", True),
        (r"\{0\}", "0", True),
        ("[1,2]", "[1,2]", True),
        (r"\infty", r"+\infty", True),
        (r"-\frac{\sqrt{2}}{2}", r"-\frac{1}{\sqrt{2}}", True),
        (r"\frac{3}{2}x", "1.5x", True),
        ("x^{-1}", r"\frac{1}{x}", True),
        ("xy^2", "x^2y", False),
        (r"12\%", "0.12", True),
        (r"12\%", "0.012", False),
        ("-3", "3", False),
        ("1/2", "2/1", False),
        (r"\sqrt{1612808}", r"898\sqrt{2}", True),
        (r"\sqrt{1612809}", r"898\sqrt{2}", False),
        ("1.25", r"\frac{5}{4}", True),
        ("35", "35.00", True),
    ]
)

CASES = (
    INTEGERS
    + DECIMALS
    + FRACTIONS
    + PERCENT
    + SCIENTIFIC
    + THOUSANDS
    + LATEX
    + SYMBOLIC
    + INTERVALS
    + SETS_TUPLES
    + EQUATIONS
    + UNITS_TEXT
    + EXTRACTION
    + ADVERSARIAL
    + MORE
)


# Where math-verify 0.9.0 (``verify(parse("$label$"), parse(response))``) disagrees with the truth
# above, and why ours is right. ``test_math_cases.py`` checks math-verify errs only on these.
_PCT = "a percentage answer; datasets store 50% as '50' (MATH) or '0.5', so % matches both"
MATH_VERIFY_WRONG = {
    (B % r"50\%", "50"): _PCT,
    (B % "50%", r"50\%"): _PCT,
    (B % r"25\%", "0.25"): _PCT,
    (B % r"25\%", "25"): _PCT,
    (B % r"12.5\%", "12.5"): _PCT,
    (B % r"50 \%", "50"): _PCT,
    (B % r"100\%", "1"): "100% is 1",
    (B % r"12\%", "0.12"): "12% is 0.12",
    (B % "7 percent", "7"): "'percent' spelled out is a unit word",
    (B % "1e3", "1000"): "E-notation 1e3 is 1000; math-verify does not read it inside LaTeX",
    (B % "2.5e-3", "0.0025"): "E-notation 2.5e-3 is 0.0025",
    (B % r"6.02\times10^{23}", "6.02e23"): "the same number written two ways",
    (B % r"1.6 \times 10^{-19}", "1.6e-19"): "the same number written two ways",
    (B % "0.000001", "1e-6"): "the same number written two ways",
    (B % r"1\,000", "1000"): r"thin space \, as a thousands separator",
    (B % "5-2t", "-2t+5"): "the same polynomial; math-verify fails on the reordering with a symbol t",
    (B % "45°", "45"): "a unicode degree sign is a unit",
    (B % r"\text{12 apples}", "12"): "a unit word inside \\text{}",
    (r"First I guessed \boxed{3}, but correcting: \boxed{4}.", "4"): "the last box is the final answer",
    (r"\boxed{1}\boxed{2}\boxed{3}", "3"): "the last box is the final answer",
    (r"\boxed{\text{the answer is } 12}", "12"): "'the answer is' inside the box is not part of the answer",
    (r"\fbox{9}", "9"): r"\fbox is a box too",
    (r"$\boxed{\textbf{(C)}\ 12}$", "12"): "AMC style '(C) 12': the choice letter precedes the value",
    (r"\boxed{\frac{1}{2}", "0.5"): (
        "an unterminated box is a truncated generation; crediting it would reward responses cut off "
        "at the length limit (ours is right for an RL reward)"
    ),
    (r"\boxed{\frac{1}{3}}", r"0.\overline{3}"): r"0.\overline{3} is exactly 1/3",
    (B % r"0.1\overline{6}", r"\frac{1}{6}"): r"0.1\overline{6} is exactly 1/6",
    (B % r"0.\overline{9}", "1"): r"0.\overline{9} = 1",
    (r"\boxed{3.}", "3"): "trailing sentence punctuation",
    (r"\boxed{3,}", "3"): "trailing sentence punctuation",
    (r"\boxed{\emptyset}", r"\varnothing"): "two symbols for the empty set",
}
