"""What a compiled step costs: collective bytes and memory read from the compiled program,
the traffic a plan predicts, and `mode=plan`'s comparison of strategies. Above the trainer:
it compiles steps; nothing in the runtime imports it."""
