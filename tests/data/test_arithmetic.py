from bdlm_jax.data import ArithmeticSource, check_arithmetic


def test_arithmetic_documents_are_deterministic_in_seed_and_index():
  a, b, c = ArithmeticSource(seed=0), ArithmeticSource(seed=0), ArithmeticSource(seed=1)
  assert [a[i] for i in range(20)] == [b[i] for i in range(20)]
  assert [a[i] for i in range(20)] != [c[i] for i in range(20)]
  assert len(a) == 10**7 and len(ArithmeticSource(0, size=5)) == 5


def test_arithmetic_documents_are_all_correct_and_use_every_op():
  src = ArithmeticSource(seed=3)
  docs = [src[i] for i in range(200)]
  for doc in docs:
    n_valid, n_total = check_arithmetic(doc)
    assert n_valid == n_total >= 4
  for op in "+-*":
    assert any(op in doc for doc in docs)


def test_check_arithmetic_counts_correct_statements():
  assert check_arithmetic("37+5=42 12*3=36 90-17=73") == (3, 3)
  assert check_arithmetic("37+5=41 12*3=36\n90-17=7") == (1, 3)
  assert check_arithmetic("no maths here, 3+ =4") == (0, 0)
  # Statements are whole numbers: "137+5=42" is not read as "37+5=42", nor "42" as "4".
  assert check_arithmetic("137+5=42") == (0, 1)
  assert check_arithmetic("2+2=45") == (0, 1)
