"""The built-in models of the examples, the CLI and the doctor: a ReLU MLP (`mlp`) and a small
BatchNorm/dropout CNN (`cnn`) as pure functions of parameter pytrees, with their losses and
metrics. Nothing in funcgrad's tools depends on them; they are what ``funcgrad train`` and the
tests train."""
