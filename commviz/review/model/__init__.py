"""review.model"""
