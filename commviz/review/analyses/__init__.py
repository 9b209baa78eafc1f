"""review.analyses"""
