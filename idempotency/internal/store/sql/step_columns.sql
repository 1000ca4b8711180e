-- A fragment: a step row's columns, in StepRow's order (scanSteps).
s.step, s.seq, s.fence, s.input_fingerprint, s.result, s.created_at
