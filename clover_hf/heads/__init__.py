"""The draft heads: their config, their modules (Clover's, Medusa's), and the token trees they draft."""
