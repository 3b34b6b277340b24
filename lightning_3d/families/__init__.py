"""What a transformers model family is, read from its config and modules alone: which token
mixers keep packed rows and context shards apart (``mixers``) and its tiny random twin
(``twin``), on the bottom floor so that data, parallel and models all read it."""
