"""review's wording: what the analyses found as a terminal table, Markdown, JSON, PNG plots and
the merged trace's timeline; nothing here judges, it only tells."""
